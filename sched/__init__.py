"""Step-level scheduling (DESIGN §6.1): the pure core and its policies, shared by the stage
runtime, the NM's capacity view, the proxy's monitor and a simulator. Nothing here opens a
socket, starts a process or reads a clock: time is passed in."""
