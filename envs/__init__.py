"""Tasks and multi-turn sandbox environments (imported as ``rollbox.envs``)."""
