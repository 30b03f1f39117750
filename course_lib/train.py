"""``python -m course_lib.train``: an alias of :mod:`course_lib.apps.train`, kept so the commands in the README
and the labs stay short."""
import sys

from course_lib.apps.train import main

if __name__ == "__main__":
    sys.exit(main())
