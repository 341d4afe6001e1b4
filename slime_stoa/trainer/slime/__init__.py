"""The only modules that import slime: settings, the rollout function and its eval path, its data
source, the loss adapter, weight publishing (and the HF names it publishes), preflight and the patch logic. Each keeps its slime imports inside the functions
slime calls, so the rest of stoa (and its tests) run without slime installed."""
