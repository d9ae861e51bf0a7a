"""The commands of ``carpool`` other than ``serve``, one module per command group; ``carpool.cli``
registers them on its group. ``common`` holds what every command shares: loading the
configuration (a bad one exits 2) and writing URLs into log lines without their credentials."""
