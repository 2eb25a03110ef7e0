"""Lesson 09: where to cut a model into two balanced stages. Walk the submodules in the order the
forward calls them (here, the order they are registered), adding up parameters; cut before the
submodule that keeps the heavier of the two stages lightest."""


def my_split_point(model):
    def params(module):
        return sum(p.numel() for p in module.parameters())

    leaves = [(name, m) for name, m in model.named_modules() if name and not list(m.children())]
    total, before, best = params(model), 0, None
    for name, module in leaves:
        heaviest = max(before, total - before)
        if before and (best is None or heaviest < best[1]):
            best = (name, heaviest)
        before += params(module)
    return best[0]
