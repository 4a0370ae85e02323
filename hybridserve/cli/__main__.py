"""`python -m hybridserve.cli` (what `torchrun -m hybridserve.cli ...` starts on every rank)."""

from hybridserve.cli import main

main()
