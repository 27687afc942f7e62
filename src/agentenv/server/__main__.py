"""``python -m agentenv.server``: the same as ``agentenv serve``."""

from agentenv.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
