"""``torchtitan.train`` on the CPU (gloo): ``torchrun --nproc-per-node 2 -m k3infra.titan.train_cpu --module
k3infra.titan --config k3_debug [--parallelism.expert_parallel_degree 2 ...]`` (same arguments as torchtitan's)."""

from k3infra.titan.cpu import use_cpu


def main() -> None:
    """`use_cpu`, then torchtitan's own entry point (``torchtitan.train.main``) with this process's arguments."""
    use_cpu()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
