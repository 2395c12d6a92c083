"""The trace of a layout (issue 78): one training step of a rank role run through the run's own code on fake tensors
and a fake process group at the layout's world size, measured (memory by category, collectives, FLOPs, checkpoint
bytes). role.py traces one rank in a process of its own; roles.py picks the distinct roles and runs one such process
each; fake.py, memory.py, collectives.py and flops.py are the pieces.
"""
