"""Grading a class: ``python -m course_lib grade CLASS/``. One job per module, in the order a submission meets them:

* :mod:`.intake` -- find the submissions, name their learners, refuse bad files with one named error, restore
  the check cells as shipped;
* :mod:`.sandbox` -- run one notebook in a bubblewrap box (read-only library, its own scratch folder, private
  ``/tmp``, PID and network namespaces), under time, memory, process and output limits, every process ended;
  :mod:`.box` what the box is made of (bubblewrap's command line, the box's uid, its scratch disk, the reaper),
  :mod:`.limits` the kernel's launch wrapper (rlimits, the memory and pids cgroups, dropping root), :mod:`.kernel`
  the grader's side of the kernel (manager, client, environment, output caps, the guard's pipe);
* :mod:`.guard` -- inside the kernel, before the notebook's first line: records each check's verdict where it is
  decided and reports what touched the library, the checks or the guard;
* :mod:`.verdicts` -- one verdict per exercise and one score per prediction, and the rules that flag a submission;
* :mod:`.report` -- the summary table, ``grades.csv`` and ``report.html``;
* :mod:`.grade` -- the command itself: all of the above, ``--jobs`` at a time.
"""
