"""Deployment: measuring a candidate on its server, choosing how production serves it, and running production.

- `promotion`: the candidate's benchmark, the gate's inputs, the version's registry fields, pruning and retraining;
- `sweep`: the drafting shapes measured on the candidate's server and the one production serves with;
- `production`: the production server (start, stop, re-measure) the promotion steps swap.
"""
