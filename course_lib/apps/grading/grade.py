"""``python -m course_lib grade SUBMISSIONS...``: grade a class's labs with the course's own checks.

Each submission (see :mod:`.intake` for names and refusals) runs headless in its own kernel, in a scratch copy,
inside a bubblewrap box, under a cell limit, a notebook limit, a memory limit, a process limit and output caps,
``--jobs`` at a time (:mod:`.sandbox`); every process it started is ended and counted. In the box each check runs
only its *run half* and writes plain data (numbers, arrays; no pickle) to the scratch folder's outbox; each
exercise's verdict is decided here, outside the box, by the exercise's *judge half* on that data
(:mod:`course_lib.checks.judge`) -- never by what the notebook printed or what the box recorded. The grader's guard
(:mod:`.guard`) stays as a second line: a submission that touched the library, the checks or the guard, or names a
library function that solves an exercise, is flagged for review and none of its exercises is graded solved
(:func:`.verdicts.flags`). Out come a progress bar, a summary table,
``grades.csv``, ``report.html`` (:mod:`.report`) and, under ``notebooks/``, each executed notebook.

Exit status: 0 when every submission was graded (whatever its verdicts), 1 when some file was refused,
2 when there was nothing to grade, 3 when the sandbox cannot run here (the line says why; ``--no-sandbox``).
"""
from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

from course_lib.apps.grading import verdicts as grading
from course_lib.apps.grading.intake import Submission, find_submissions, is_check_cell
from course_lib.apps.grading.report import Graded, summary_table, write_csv, write_html
from course_lib.apps.grading.kernel import OUTBOX_DIR
from course_lib.apps.grading.sandbox import BoxedRun, Limits, bwrap_problem, run_boxed, warm_bytecode
from course_lib.checks import registry

__all__ = ["grade", "read_results", "cmd_grade"]


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _error(cell) -> str | None:
    err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
    return None if err is None else grading.first_line(f"{err.get('ename')}: {err.get('evalue')}")


def _cell_index(nb, ex) -> int:
    return next((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and ex.cell in c.source), len(nb.cells))


def read_results(lab: str, nb, run: BoxedRun | None = None, outbox: Path | None = None):
    """(exercise results, predictions, printed states, recorded states) from an executed lab notebook.

    With ``outbox`` (a graded run), each verdict is the exercise's **judge** run here, in the grader's process, on the
    plain data the check's run half wrote there (:func:`course_lib.checks.judge.read_outbox`): no printed text and no
    record from the box decides it. Without one (a notebook executed elsewhere, never graded) it is read from the check
    cells' printed lines. ``printed`` / ``recorded`` (what the cells printed, what the guard recorded) feed the flags
    only. Results are in the lab's own order."""
    from course_lib.checks.judge import read_outbox
    checks = [c for c in nb.cells if is_check_cell(c)]
    stopped = run.stopped if run is not None else None
    recorded = {}
    for rec in (run.records if run is not None else []):
        if rec.get("kind") == "check" and isinstance(rec.get("name"), str):
            recorded[rec["name"]] = (str(rec.get("state")), str(rec.get("text", "")))
    judged = read_outbox(outbox, registry.exercises(lab)) if outbox is not None else {}
    first_timeout = min(run.timed_out_cells) if run is not None and run.timed_out_cells else None
    results, printed = [], {}
    for ex in sorted(registry.exercises(lab), key=lambda e: _cell_index(nb, e)):
        call = f"{ex.check.__name__}("
        mine = [c for c in checks if call in c.source] or checks
        own = [c for c in nb.cells if c.cell_type == "code" and ex.cell in c.source and c not in mine]
        error = next(filter(None, (_error(c) for c in own + mine)), None)
        ran = any(c.get("execution_count") is not None or c.get("outputs") for c in mine)
        text = "\n".join(_text(c) for c in mine)
        printed[ex.name] = registry.verdict(ex, text)[0]
        if first_timeout is not None and first_timeout < _cell_index(nb, ex) and ex.name not in recorded:
            cell = nb.cells[first_timeout]
            limit = next((o.get("evalue", "") for o in cell.get("outputs", []) if o.get("ename") == "CellTimeout"), "")
            error = f"not reached: cell {first_timeout + 1} {limit or 'ran past the cell limit'}; the cells after it ran without its results"
        stop = None if ran else (stopped or "its check cell never ran")
        if outbox is not None:
            results.append(grading.judged_result(ex, judged[ex.name], error=error, stopped=stop))
        else:
            results.append(grading.exercise_result(ex, text, error=error, stopped=stop))
    return (results, grading.predictions("\n".join(_text(c) for c in checks)), printed,
            {name: state for name, (state, _) in recorded.items()})


def _changed_sources(submitted, shipped) -> list[str]:
    """The code cells the learner edited or added (the shipped lab's cells, matched by id or source, excluded)."""
    ids = {c.get("id"): c.source for c in shipped.cells if c.get("id")}
    sources = {c.source for c in shipped.cells}
    return [c.source for c in submitted.cells if c.cell_type == "code" and c.source not in sources
            and ids.get(c.get("id"), None) != c.source]


async def _grade_one(sub: Submission, limits: Limits, keep: Path | None) -> Graded:
    scratch = Path(tempfile.mkdtemp(prefix="course-grade-"))      # no learner name: nothing to guess from
    try:
        name = sub.lab.path.name
        nbformat.write(sub.nb, scratch / name)                 # the scratch copy the kernel works beside
        nb = nbformat.read(scratch / name, as_version=4)
        run = await run_boxed(nb, scratch, limits, lab=sub.lab.lab)
        outbox = scratch / OUTBOX_DIR
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, keep / f"{sub.learner}_{name}")
        results, preds, printed, recorded = read_results(sub.lab.lab, nb, run, outbox)
        found = grading.flags(run.records, run.nonce, run.stopped, printed, recorded,
                              _changed_sources(sub.nb, sub.lab.nb), registry.exercises(sub.lab.lab))
        if found:
            results = [grading.ExerciseResult(r.lab, r.name, "flagged", None, r.detail) if r.verdict == "solved" else r
                       for r in results]
        # In the box, what the kernel left dies with its PID namespace: worth a note only outside it.
        left = [f"{run.leftovers} process(es) left after the kernel stopped, killed"
                ] if run.leftovers and not run.sandboxed else []
        capped = [f"output of cell(s) {', '.join(str(i + 1) for i in run.truncated_cells)} cut at the cap"
                  ] if run.truncated_cells else []
        return Graded(sub.learner, sub.lab.lab, str(sub.path), results, preds, run.seconds,
                      max(run.processes, run.leftovers), run.stopped, sub.notes + run.bounds + left + capped,
                      flags=[f"{rule}: {detail}" for rule, detail in found])
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
    if subs and limits.sandbox:
        warm_bytecode(jax=any("jax" in c.source for s in subs for c in s.lab.nb.cells))
    rows = asyncio.run(_grade_all(subs, limits, jobs, None if out is None else Path(out) / "notebooks", progress))
    rows += [Graded(r.learner or "?", "", str(r.path), error=r.error) for r in refused]
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_csv(rows, Path(out) / "grades.csv")
        write_html(rows, Path(out) / "report.html", title=f"Grades: {', '.join(Path(p).name for p in paths)}")
    return rows


def cmd_grade(args) -> int:
    limits = Limits(cell_s=args.cell_timeout, notebook_s=args.timeout, memory_bytes=int(args.memory_gb * 2**30),
                    scratch_bytes=int(args.scratch_gb * 2**30),
                    nproc=args.processes, sandbox=not args.no_sandbox)
    problem = bwrap_problem() if limits.sandbox else None
    if problem:
        print(f"course_lib grade: refused: {problem}", file=sys.stderr)
        return 3
    if not limits.sandbox:
        print("course_lib grade: --no-sandbox: the notebooks see the disk and the network as you do "
              "(limits, the guard and the verdicts still hold)", file=sys.stderr)
    rows = grade(args.submissions, args.labs, limits, args.jobs, args.out)
    print(summary_table(rows))
    graded = [g for g in rows if g.error is None]
    print(f"{len(graded)} graded, {len(rows) - len(graded)} refused; wrote {args.out / 'grades.csv'} "
          f"and {args.out / 'report.html'}")
    if not graded:
        return 2
    return 1 if len(graded) < len(rows) else 0
