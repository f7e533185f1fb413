"""One module per CLI verb: its command function parses nothing (``ipw.cli`` does), calls the layers
below, renders with rich and returns an exit code. (``ipw.rescore``'s work belongs here too.)"""
