"""How a cluster of processes is formed: environment contracts, rendezvous, scheduler, local launcher.

Imports nothing above itself; ``autopar.comm`` builds the torch.distributed process group on top of the
:class:`~autopar.cluster.rendezvous.Membership` this package produces.
"""
