from longmoe.model.transformer import Block, LMHead, MoETransformer

__all__ = ["MoETransformer", "Block", "LMHead"]
