"""Emulated accelerator nodes: real processes and real math, modelled time.

`specs` holds the devices and links (every figure with its public source), `cost` counts an
operation's FLOPs and bytes on the meta device and turns them into seconds, `memory` adds up what a
rank would hold on the device.
"""
