"""The folder ``memascend run`` puts first on ``PYTHONPATH``: its ``sitecustomize.py`` is the start-up hook
(a package only so that the wheel ships it; nothing imports it as ``memascend...autoapply_site``)."""
