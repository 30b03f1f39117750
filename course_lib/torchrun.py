"""``python -m course_lib.torchrun``: an alias of :mod:`course_lib.apps.torchrun` (torchrun, with the capstone's
flags checked before any worker starts and a quiet exit), kept short like the other commands."""
import sys

from course_lib.apps.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
