"""`python -m exactrl ...` is the `exactrl` command (torchrun and `exactrl train --nproc` start ranks so)."""

from exactrl.cli import main

raise SystemExit(main())
