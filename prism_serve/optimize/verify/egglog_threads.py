"""egglog on one thread, for reproducible proofs and pruning: imported by every module that runs egglog.

egglog matches rules on rayon's global thread pool, one thread per core unless RAYON_NUM_THREADS
says otherwise, and its maintainers aim for deterministic results on one thread only (egglog
issues #793 and #863: database sizes differ from run to run when parallel). Under a
bounded schedule the e-graph after N rounds then depends on thread timing: CI found the fused
qk_norm_attention kernel unproven after 24 rounds, its e-graph smaller than this machine's after
12 (which proves it after 17, on one thread or eight). On one thread a proof, and the generator's
abstract-expression verdicts, are the same on every run and machine, at the same speed here
(0.4 s for that proof). rayon sizes its pool when first used, so this holds where nothing in the
process used rayon before; a RAYON_NUM_THREADS set by the user is kept, and child processes inherit it.
"""

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")
