# ROLLBOX-HIDDEN-TEST-MARKER-5d2e9c: the agent must never see this file.
import sys

sys.path.insert(0, "/app")
from slug import slugify

CASES = {
    "Hello, World!": "hello-world",
    "  Rollbox -- Harbor  ": "rollbox-harbor",
    "Already-a-slug": "already-a-slug",
    "Ünïcödé & 42 Things": "n-c-d-42-things",
    "": "",
}
failed = [(text, slugify(text), want) for text, want in CASES.items() if slugify(text) != want]
for text, got, want in failed:
    print(f"slugify({text!r}) = {got!r}, want {want!r}")
sys.exit(1 if failed else 0)
