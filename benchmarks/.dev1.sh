export MKC_CACHE_DIR=$PWD/.mkc-cache/h PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
timeout 120 python3 -m pytest -q -x tests/test_gpu.py -k "profile_phases_are_ordered" > $OUT/test.log 2>&1; echo "test rc $?" >> $OUT/test.log
mkdir -p $OUT/p
timeout 330 python3 benchmarks/megakernel_step.py --batch 1 4 --reps 10 --options profile_phases=1 --profile $OUT/p > $OUT/prof.log 2>&1; echo "rc $?" >> $OUT/prof.log
ls -la $OUT/p
