"""``python -m course_lib.train``: an alias of :mod:`course_lib.apps.train`, kept so the commands in docs/clusters.md
and the labs stay short."""
from course_lib.apps.train import run_and_exit

if __name__ == "__main__":
    run_and_exit()
