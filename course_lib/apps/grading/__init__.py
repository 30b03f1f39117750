"""Grading a class: ``python -m course_lib grade CLASS/``. One job per module, in the order a submission meets them:

* :mod:`.intake` -- find the submissions, name their learners, refuse bad files with one named error, restore
  the check cells as shipped;
* :mod:`.sandbox` -- run one notebook in a bubblewrap box (read-only library, its own scratch folder, private
  ``/tmp``, PID and network namespaces), under time, memory, process and output limits, every process ended;
  :mod:`.box` what the box is made of (bubblewrap's command line, the box's uid, its scratch disk, the reaper),
  :mod:`.limits` the kernel's launch wrapper (rlimits, the memory and pids cgroups, dropping root), :mod:`.kernel`
  the grader's side of the kernel (manager, client, environment, output caps, the guard's pipe);
* :mod:`.guard` -- inside the kernel, before the notebook's first line: the second line, which reports what touched
  the library, the checks or the guard (verdicts are not decided in the kernel: each check's run half writes plain
  data to the scratch folder's outbox, :mod:`course_lib.checks.judge`);
* :mod:`.verdicts` -- one verdict per exercise (its judge's, run in the grader's process on that plain data) and one
  score per prediction, and the rules that flag a submission (a library solution named in a cell among them);
* :mod:`.report` -- the summary table, ``grades.csv`` and ``report.html``;
* :mod:`.grade` -- the command itself: all of the above, ``--jobs`` at a time.
"""
