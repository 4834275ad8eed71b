"""The ground floor: helpers with no project imports of their own, which every other package may import."""
