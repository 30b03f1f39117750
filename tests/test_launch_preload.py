"""The fork server's two-stage preload (launch/preload.py): the heavy imports stay out of a kernel's first
ranks (the cold start `bench launch` measures) and reach every later pool; the notebook side imports no torch
for a CPU launch; ``RunResult.startup`` carries the milestones the bench prints. (`make bench WHAT=launch` itself
runs in tests/test_readme_commands.py.) Timings are never asserted here: a shared 2-core machine."""
import os
import subprocess
import sys
import textwrap

ENV = dict(os.environ, OMP_NUM_THREADS="1")


_STAGES = textwrap.dedent("""
    import sys, time
    from course_lib import launch
    def heavy():
        import sys
        return "torch._dynamo" in sys.modules and "torch.distributed.fsdp" in sys.modules
    if __name__ == "__main__":
        first = launch.run(heavy, world_size=2)
        assert "torch" not in sys.modules, "the notebook side imported torch for a CPU launch"
        assert set(first.startup) == {"fork_server_asked", "pool_asked", "first_rank_forked", "last_rank_forked",
                                      "all_ranks_ready"}, first.startup
        deadline = time.monotonic() + 60
        later = launch.run(heavy, world_size=2, fresh=True)
        while not all(later) and time.monotonic() < deadline:
            time.sleep(0.5)
            later = launch.run(heavy, world_size=2, fresh=True)
        print(list(first), list(later), later.startup is not None)
""")


def test_first_ranks_start_before_the_heavy_imports_and_later_pools_have_them(tmp_path):
    script = tmp_path / "stages.py"
    script.write_text(_STAGES)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "[False, False] [True, True] True"
