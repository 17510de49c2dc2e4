"""What the launcher puts in front of every rank's script (this folder goes first on the worker's ``PYTHONPATH``).

Its ``sitecustomize`` runs before the script and needs nothing but the standard library: it must not import torch
(or autopar, which imports torch) before the script had its say about the environment.
"""
import os

BOOT_DIR = os.path.dirname(os.path.abspath(__file__))
