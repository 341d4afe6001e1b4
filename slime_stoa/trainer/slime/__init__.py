"""The only modules that import slime: settings, the rollout function, its data source, the loss
adapter, weight publishing, preflight and the patch logic. Each keeps its slime imports inside the functions
slime calls, so the rest of stoa (and its tests) run without slime installed."""
