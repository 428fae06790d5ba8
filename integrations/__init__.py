"""Plug-ins for trainers and harnesses (imported as ``rollbox.integrations``)."""
