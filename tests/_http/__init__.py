"""Real HTTP servers on loopback for the tests of the HTTP store: nginx, and a server of faults."""
