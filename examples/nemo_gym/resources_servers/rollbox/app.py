"""The entry point `ng_run` starts for the `rollbox` resources server (see ../../rollbox_shell.yaml)."""

from rollbox.integrations.nemo_gym import RollboxResourcesServer

if __name__ == "__main__":
    RollboxResourcesServer.run_webserver()
