"""Tools on top of the roles: the command line, the local launcher, experiments and reports."""
