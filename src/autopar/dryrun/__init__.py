"""Dry run: the user's unmodified script runs on this CPU as rank r of a world of N -- torch's fake process group,
tensors without storage (``FakeTensorMode``) -- through autopar's real parallelization, and says what each rank's
memory peaks at before anyone books the cluster (``autopar launch --dry-run``, ``msrun --sim_level``).

The pieces: :mod:`.fake_world` (the fake process group and what a fake tensor cannot answer), :mod:`.tracker` (live
tensor storage, peak and its parts), :mod:`.runner` (one simulated rank: ``python -m autopar.dryrun.runner``),
:mod:`.driver` (which ranks to simulate, the report and ``dryrun.json``).
"""
