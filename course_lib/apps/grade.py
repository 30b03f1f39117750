"""``python -m course_lib grade SUBMISSIONS...``: grade a class's labs with the course's own checks.

Each submission (see :mod:`~course_lib.apps.grade_intake` for names and refusals) runs headless in its own
kernel, in a scratch copy, under a cell limit, a notebook limit and a memory limit, ``--jobs`` at a time
(:mod:`~course_lib.apps.grade_sandbox`); every process it started is ended and counted. Its check cells'
printed lines are then read into one verdict per exercise and one score per prediction
(:mod:`course_lib.checks.grading`). Out come a progress bar, a summary table, ``grades.csv``,
``report.html`` (:mod:`~course_lib.apps.grade_report`) and, under ``notebooks/``, each executed notebook.

Exit status: 0 when every submission was graded (whatever its verdicts), 1 when some file was refused,
2 when there was nothing to grade.
"""
from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

from course_lib.apps.grade_intake import Refused, Submission, find_submissions, is_check_cell
from course_lib.apps.grade_report import Graded, summary_table, write_csv, write_html
from course_lib.apps.grade_sandbox import Limits, run_boxed
from course_lib.checks import grading, registry

__all__ = ["grade", "read_results", "cmd_grade"]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _error(cell) -> str | None:
    err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
    return None if err is None else grading.first_line(f"{err.get('ename')}: {err.get('evalue')}")


def read_results(lab: str, nb, stopped: str | None = None):
    """(exercise results, predictions) from an executed lab notebook (outputs of its check cells only)."""
    checks = [c for c in nb.cells if is_check_cell(c)]
    results = []
    for ex in registry.exercises(lab):
        call = f"{ex.check.__name__}("
        mine = [c for c in checks if call in c.source] or checks
        own = [c for c in nb.cells if c.cell_type == "code" and ex.cell in c.source and c not in mine]
        error = next(filter(None, (_error(c) for c in own + mine)), None)
        ran = any(c.get("execution_count") is not None or c.get("outputs") for c in mine)
        results.append(grading.exercise_result(ex, "\n".join(_text(c) for c in mine), error=error,
                                               stopped=None if ran else (stopped or "its check cell never ran")))
    return results, grading.predictions("\n".join(_text(c) for c in checks))


async def _grade_one(sub: Submission, limits: Limits, keep: Path | None) -> Graded:
    scratch = Path(tempfile.mkdtemp(prefix=f"course-grade-{sub.learner[:20]}-"))
    try:
        name = sub.lab.path.name
        nbformat.write(sub.nb, scratch / name)                 # the scratch copy the kernel works beside
        nb = nbformat.read(scratch / name, as_version=4)
        run = await run_boxed(nb, scratch, limits)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, keep / f"{sub.learner}_{name}")
        results, preds = read_results(sub.lab.lab, nb, run.stopped)
        left = [f"{run.leftovers} process(es) left after the kernel stopped, killed"] if run.leftovers else []
        return Graded(sub.learner, sub.lab.lab, str(sub.path), results, preds, run.seconds,
                      max(run.processes, run.leftovers), run.stopped, sub.notes + left)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _grade_all(subs: list[Submission], limits: Limits, jobs: int, keep: Path | None, progress: bool):
    from tqdm.auto import tqdm
    gate = asyncio.Semaphore(max(1, jobs))
    bar = tqdm(total=len(subs), desc="grading", unit="nb", file=sys.stderr, dynamic_ncols=True, disable=not progress)

    async def one(sub):
        async with gate:
            try:
                g = await _grade_one(sub, limits, keep)
            except Exception as exc:        # the grader's own failure on one file must not stop the class
                g = Graded(sub.learner, sub.lab.lab, str(sub.path),
                           error=f"grader error: {type(exc).__name__}: {grading.first_line(exc)}")
        bar.update(1)
        bar.set_postfix_str(f"{g.learner} {sum(r.verdict == 'solved' for r in g.results)}/{len(g.results)} solved")
        return g
    try:
        return await asyncio.gather(*(one(s) for s in subs))
    finally:
        bar.close()


def grade(paths: list[Path], labs_dir: Path, limits: Limits = Limits(), jobs: int = 2, out: Path | None = None,
          progress: bool = True) -> list[Graded]:
    """Grade every submission under ``paths``; refused files come back as rows with ``error`` set.
    With ``out``, write ``grades.csv``, ``report.html`` and ``notebooks/`` there."""
    subs, refused = find_submissions(paths, labs_dir)
    registry.exercises()         # import every lab's checks now, not inside the event loop the kernels share
    rows = asyncio.run(_grade_all(subs, limits, jobs, None if out is None else Path(out) / "notebooks", progress))
    rows += [Graded(r.learner or "?", "", str(r.path), error=r.error) for r in refused]
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_csv(rows, Path(out) / "grades.csv")
        write_html(rows, Path(out) / "report.html", title=f"Grades: {', '.join(map(str, paths))}")
    return rows


def cmd_grade(args) -> int:
    limits = Limits(cell_s=args.cell_timeout, notebook_s=args.timeout, memory_bytes=int(args.memory_gb * 2**30))
    rows = grade(args.submissions, args.labs, limits, args.jobs, args.out)
    print(summary_table(rows))
    graded = [g for g in rows if g.error is None]
    print(f"{len(graded)} graded, {len(rows) - len(graded)} refused; wrote {args.out / 'grades.csv'} "
          f"and {args.out / 'report.html'}")
    if not graded:
        return 2
    return 1 if len(graded) < len(rows) else 0
