"""``python -m chatcore.cli``: the same command line as ``chatcore``, for launchers such as
``torchrun --nproc_per_node=N -m chatcore.cli train model ...``."""

from chatcore.cli import main

if __name__ == "__main__":
    main()
