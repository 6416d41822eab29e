"""scripts/dev/profile_step.py's timeline summaries (what the stream measurements of docs/performance.md rest
on), on made-up kernel records: the union of busy intervals, and each stage's span within a step."""
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent


def _load():
    sys.path.insert(0, str(REPO / "scripts" / "dev"))
    spec = importlib.util.spec_from_file_location("profile_step", REPO / "scripts" / "dev" / "profile_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


profile_step = _load()


def _kernel(name, start, end, stream):
    return SimpleNamespace(name=name, device_resource_id=stream,
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def test_busy_us_is_the_union_of_intervals():
    assert profile_step.busy_us([]) == 0.0
    assert profile_step.busy_us([(0, 10), (5, 12), (20, 25)]) == 17.0     # overlap counted once, gap not at all
    assert profile_step.busy_us([(3, 4), (0, 10)]) == 10.0                # contained, any order


def test_stream_overlap_and_stage_spans(capsys, monkeypatch):
    monkeypatch.setattr(profile_step, "STEPS", 2)
    kernels = []
    for step in range(2):           # two identical steps 10 ms apart: the LLM on one stream, the talker beside it
        t = step * 10_000
        kernels += [_kernel("_ssm_step_kernel", t + 0, t + 4000, 7), _kernel("_relu_square_kernel", t + 4000, t + 6000, 7),
                    _kernel("_decode_attention_vector_kernel", t + 1000, t + 3000, 9)]
    profile_step.print_stream_overlap(kernels)
    profile_step.print_stage_spans(kernels, first_kernels=2)
    out = capsys.readouterr().out
    assert "wall 8.00 ms per step, some kernel running 6.00 ms" in out
    assert "stream 7: 2 kernels, running 6.00 ms per step" in out
    assert "stream 9: 1 kernels, running 2.00 ms per step" in out
    assert "llm 0.00-6.00" in out and "talker 1.00-3.00" in out and "step 0.00-6.00" in out


def test_host_profile_names_the_functions_a_step_spends_its_host_time_in(capsys):
    import time

    def guard_checks():             # stands in for a back end's per-step host work before its last launch
        time.sleep(0.002)

    def step_to_host():
        guard_checks()
        launched = time.perf_counter()
        time.sleep(0.030)           # the wait for the GPU: not host time to the launch
        return SimpleNamespace(launched=launched)
    profile_step.print_host_profile(step_to_host, calls=5, top=5)
    out = capsys.readouterr().out
    median = float(out.split("to its last launch (no profiler): median ")[1].split(" ms")[0])
    assert 2.0 <= median < 30.0     # the 2 ms before the launch, not the 30 ms wait after it
    assert "5 steps" in out and "guard_checks" in out   # cProfile's table names the function


def test_host_profile_without_graphs_is_refused_naming_the_setting(tmp_path):
    import subprocess
    for value, extra in (("5", []), ("-1", ["profile.graphs=true"])):
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "dev" / "profile_step.py"), f"profile.host={value}",
                               *extra, f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert f"profile.host={value}" in done.stderr and "profile.graphs=true" in done.stderr, done.stderr
