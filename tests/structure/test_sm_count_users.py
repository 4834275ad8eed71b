"""Code that sizes GPU work from the SM count is known and checked at several counts.

Under CUDA MPS a process sees only its share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: 112 of an H100's 132
at 85 %), and a kernel that sized a persistent grid, a split-K reduction or a workspace from the full count (or
assumed all its programs resident at once) could deadlock, skip tiles or read partial sums nobody wrote. The one
user today is decode attention's split count (independent slices merged by their log-sum-exp), checked at 1, 7,
112 and 132 SMs in tests/kernels/interpreted/check_decode_denoise.py. A new user belongs in USERS with such a check.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATTERN = re.compile(r"multi_processor_count|\bnum_sms\(|MultiProcessorCount")
USERS = {"kernels/_backend.py",            # num_sms(): the one place that reads it
         "kernels/decode_attention.py",    # default_num_splits(): 2 programs per SM
         "deploy/mps_probe.py",            # reports the SM count the process sees
         "bench/bench_kernels.py",         # names the GPU in its report
         "services/model/streams.py"}      # a green context's share (tests/model/test_engine_streams.py)


def test_only_known_code_reads_the_sm_count():
    found = set()
    for top in ("kernels", "services", "shm_transfer", "deploy", "bench"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    with open(path, encoding="utf-8") as fh:
                        if PATTERN.search(fh.read()):
                            found.add(os.path.relpath(path, ROOT))
    assert found <= USERS, f"new code reads the SM count (check it at several counts, then list it): {found - USERS}"
