"""AgentEnv: isolated sandboxes for agent RL with millisecond snapshot, restore and fork."""

__version__ = "0.1.0"
