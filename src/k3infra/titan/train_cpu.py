"""``torchtitan.train`` on the CPU (gloo): ``torchrun --nproc-per-node 2 -m k3infra.titan.train_cpu --module
k3infra.titan --config k3_debug [--parallelism.expert_parallel_degree 2 ...]`` (same arguments as torchtitan's)."""

from k3infra.titan.cpu import use_cpu
from k3infra.titan.train import main as train_main


def main() -> None:
    """`use_cpu`, then `k3infra.titan.train.main` (torchtitan's own entry point) with this process's arguments."""
    use_cpu()
    train_main()


if __name__ == "__main__":
    main()
