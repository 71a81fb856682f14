"""``python -m paramserver.cli``: the same as the ``paramserver`` console script
(what torchrun's ``-m paramserver.cli`` runs)."""

from paramserver.cli.main import main

main(prog_name="paramserver")
