#!/bin/bash
# Runs from the working directory (/app); writes several rewards to reward.json.
python3 -m pytest -q -p no:cacheprovider --rootdir=/tests -rA /tests/test_stats.py \
    > /logs/verifier/pytest.txt 2>&1
status=$?
cat /logs/verifier/pytest.txt
passed=$(grep -c '^PASSED' /logs/verifier/pytest.txt)
if [ "$status" = "0" ] && [ "$passed" = "4" ]; then reward=1; else reward=0; fi
printf '{"reward": %s, "tests_passed": %s}\n' "$reward" "$passed" > /logs/verifier/reward.json
