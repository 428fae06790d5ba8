#!/bin/bash
# ROLLBOX-SOLUTION-MARKER-8a41f0: only the oracle sees this file.
cat > /app/slug.py <<'PY'
import re


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
PY
