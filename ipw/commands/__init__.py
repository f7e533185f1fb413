"""One module per CLI verb: its command function parses nothing (``ipw.cli`` does; it gets one frozen object
per option group of ``ipw.options``), calls the layers below, renders with rich and returns an exit code.  A
command never calls another: what two share is the library's, or ``commands.output``'s."""
