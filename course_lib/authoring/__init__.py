"""The authoring layer: derive labs/ from solutions/, validate notebooks, run them headless.

:mod:`~course_lib.authoring.labs` (solution -> lab), :mod:`~course_lib.authoring.validate`,
:mod:`~course_lib.authoring.run` (run-solutions and its one-screen table), :mod:`~course_lib.authoring.nbgrader`
(the labs as nbgrader source notebooks).
This package imports neither torch nor JAX; ``python -m course_lib`` is :mod:`course_lib.apps.cli`.
"""
from course_lib.authoring.labs import (DEFAULT_HINT, LAB_GLOB, MARKDOWN_STUB, STUB_COMMENT, AuthoringError, lab_text, make_lab, plan_labs, read_notebook,
                                       rel_path, stale_labs, transform_source, write_labs)
from course_lib.authoring.run import NotebookRun, format_table, parse_banner, run_all, run_notebook
from course_lib.authoring.validate import validate_notebook
from course_lib.authoring.nbgrader import nbgrader_source, write_nbgrader_sources

__all__ = [
    "LAB_GLOB", "DEFAULT_HINT", "STUB_COMMENT", "MARKDOWN_STUB", "AuthoringError", "transform_source", "make_lab", "lab_text", "read_notebook", "rel_path",
    "plan_labs", "write_labs", "stale_labs", "validate_notebook", "NotebookRun", "parse_banner",
    "run_notebook", "run_all", "format_table", "nbgrader_source", "write_nbgrader_sources",
]
