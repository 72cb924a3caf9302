"""The channel an algorithm needs from its communicator: a private duplicate with bounded waits
(context), the node layout, shared memory, progress threads, call checks and agreement, the
watchdog and roll call, failure notices."""
