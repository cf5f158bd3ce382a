"""Never runs: the workspace's pin is wrong, so the build stops at the fetch (see WORKSPACE)."""
import moe_ep

print(moe_ep.list_backends())
