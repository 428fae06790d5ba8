#!/bin/bash
# Harbor runs this from the working directory after the agent; it writes the reward.
if [ "$(tr -d '[:space:]' < /app/count.txt 2>/dev/null)" = "4" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo "count.txt is missing or wrong"
    echo 0 > /logs/verifier/reward.txt
fi
