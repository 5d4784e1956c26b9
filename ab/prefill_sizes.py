# session 43: piecewise prefill capture sizes past 512 (eager chunks past 512 tokens are host-bound): the same
# bench_prefill points with the default sizes and with 640..1024 added, in one process each
import sys
import tpgraph.graphs.config as gc
extra = tuple(int(s) for s in sys.argv[1].split(",")) if sys.argv[1] != "-" else ()
d = list(gc.GraphConfig.__init__.__defaults__)
d[3] = tuple(sorted(set(d[3]) | set(extra)))
gc.GraphConfig.__init__.__defaults__ = tuple(d)
sys.argv = ["bench_prefill.py", *sys.argv[2:]]
sys.path.insert(0, "bench")
import runpy
runpy.run_path("bench/bench_prefill.py", run_name="__main__")
