"""The durable capture writers, one concern a module.

budget      the in-flight byte budget and its overload policies
threads     the publishing threads
state       what the local writer holds per open capture
publishing  one capture's files, manifest and receipt
stages      pipeline-stage parts and their merge into one manifest
local       `CaptureWriter`: the in-process writer (accumulation)
ring        the shared-memory rings a writer process takes rows through
protocol    the typed messages between the engine and a writer process
process     `ProcessCaptureWriter`: the engine-side proxy of one writer process
child       the writer process's loop
glibc       the writer process's malloc tuning
fanout      `ProcessWriterPool`: several writer processes behind one sink
factory     the writer an engine worker's settings ask for
"""
