"""Code ``benchmarks/scale_e2e.py`` runs in other processes: :data:`STEP_HOOK`, installed as
``sitecustomize`` in the servers' environment, times vLLM's scheduler step inside the engine
process; :data:`PROBE` measures how late a sleeping process wakes (the machine's own stalls).
"""

STEP_HOOK = """
import gc, importlib.abc, importlib.util, os, sys, threading, time, traceback
_DIR = os.environ.get("LGKV_STEP_LOG_DIR")
_WHY = float(os.environ.get("LGKV_STEP_WHY_S") or 0)
_NOW = {"t0": None, "tid": None, "dumped": False}

def _watch():
    # Samples every 5 ms; a step running past _WHY seconds gets every thread's stack written
    # once (what the scheduler thread is doing, and who else holds the process meanwhile).
    path = os.path.join(_DIR, f"why-{os.getpid()}.log")
    while True:
        time.sleep(0.005)
        t0 = _NOW["t0"]
        if t0 is None or _NOW["dumped"] or time.perf_counter() - t0 < _WHY:
            continue
        _NOW["dumped"] = True
        names = {t.ident: t.name for t in threading.enumerate()}
        with open(path, "a") as f:
            f.write(f"=== {time.time():.4f} step running {time.perf_counter() - t0:.3f} s\\n")
            for tid, frame in sys._current_frames().items():
                if tid == threading.get_ident():
                    continue
                mark = " (scheduler)" if tid == _NOW["tid"] else ""
                f.write(f"--- {names.get(tid, tid)}{mark}\\n")
                f.write("".join(traceback.format_stack(frame)[-8:]))

def _gc_log(phase, info, _t={}):
    if phase == "start":
        _t["t"] = time.perf_counter()
    elif "t" in _t:
        took = time.perf_counter() - _t.pop("t")
        if took > 0.01:
            with open(os.path.join(_DIR, f"gc-{os.getpid()}.log"), "a") as f:
                f.write(f"{time.time():.4f} gen{info['generation']} {took:.3f}s\\n")

def _patch(module):
    cls = module.Scheduler
    out = {}
    if _WHY and not out.get("watch"):
        out["watch"] = threading.Thread(target=_watch, daemon=True, name="step-why")
        out["watch"].start()
        gc.callbacks.append(_gc_log)
    def wrap(name, tag):
        orig = getattr(cls, name)
        def timed(self, *args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            _NOW.update(t0=t0, tid=threading.get_ident(), dumped=False)
            try:
                return orig(self, *args, **kwargs)
            finally:
                _NOW["t0"] = None
                took, cpu = time.perf_counter() - t0, time.thread_time() - c0
                f = out.get("f")
                if f is None:
                    f = out["f"] = open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a", buffering=1)
                f.write(f"{time.time():.4f} {tag} {took:.6f} {cpu:.6f}\\n")
        setattr(cls, name, timed)
    wrap("schedule", "s")
    wrap("update_from_output", "u")

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.core.sched.scheduler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec

if _DIR:
    sys.meta_path.insert(0, _Hook())
"""
"""Times vLLM's scheduler step in the engine process (installed as ``sitecustomize``)."""


PROBE = """
import sys, time
# Another process: sleeps 2 ms at a time and notes each wake-up later than 20 ms (when the
# machine, not the engine, kept it off a core).
with open(sys.argv[1], "a", buffering=1) as f:
    while True:
        t = time.perf_counter()
        time.sleep(0.002)
        late = time.perf_counter() - t - 0.002
        if late > 0.02:
            f.write(f"{time.time():.4f} {late:.4f}\\n")
"""
