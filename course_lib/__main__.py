"""``python -m course_lib``: the course's command line (see :mod:`course_lib.apps.cli`)."""
import sys

from course_lib.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
