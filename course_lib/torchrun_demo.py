"""``python -m course_lib.torchrun_demo``: an alias of :mod:`course_lib.apps.torchrun_demo`, kept so the commands in docs/clusters.md
and the labs stay short."""
import sys

from course_lib.apps.torchrun_demo import main

if __name__ == "__main__":
    sys.exit(main())
