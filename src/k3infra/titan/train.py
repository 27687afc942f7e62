"""torchtitan's trainer for the K3 spec on any device: ``torchrun --nproc-per-node N -m k3infra.titan.train
--module k3infra.titan --config k3_mini [...]`` (torchtitan's own arguments). Unlike ``-m torchtitan.train`` it
imports `k3infra.titan` (and so its torch compatibility names, `compat.ensure_torch_compat`) before torchtitan's
trainer module."""

import k3infra.titan  # noqa: F401  (the compatibility names first)


def main() -> None:
    """torchtitan's own entry point (``torchtitan.train.main``) with this process's arguments."""
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
