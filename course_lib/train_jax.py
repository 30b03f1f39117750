"""``python -m course_lib.train_jax``: an alias of :mod:`course_lib.apps.train_jax`, kept so the commands in docs/clusters.md
and the labs stay short."""
import sys

from course_lib.apps.train_jax import main

if __name__ == "__main__":
    sys.exit(main())
