(define (problem plan_trial_T20261122_100006_000006)
    (:domain alfred)
    (:objects
        agent1 - agent
        PencilType - otype
        DeskType - rtype
        ShelfType - rtype
        DrawerType - rtype
        Pencil_bar__plus_01_dot_52_bar__plus_00_dot_75_bar__minus_01_dot_30 - object
        Pencil_bar__minus_01_dot_34_bar__plus_00_dot_34_bar__plus_01_dot_83 - object
        Desk_bar__plus_01_dot_50_bar__plus_00_dot_00_bar__minus_01_dot_45 - receptacle
        Shelf_bar__minus_01_dot_36_bar__plus_00_dot_34_bar__plus_01_dot_80 - receptacle
        Drawer_bar__plus_01_dot_38_bar__plus_00_dot_59_bar__minus_01_dot_40 - receptacle
        loc_bar_5_bar__minus_3_bar_2_bar_45 - location
        loc_bar__minus_4_bar_5_bar_0_bar_60 - location
        loc_bar_4_bar__minus_3_bar_2_bar_30 - location
        loc_bar_0_bar_0_bar_0_bar_30 - location
        )
    (:init
        (receptacleType Desk_bar__plus_01_dot_50_bar__plus_00_dot_00_bar__minus_01_dot_45 DeskType)
        (receptacleType Shelf_bar__minus_01_dot_36_bar__plus_00_dot_34_bar__plus_01_dot_80 ShelfType)
        (receptacleType Drawer_bar__plus_01_dot_38_bar__plus_00_dot_59_bar__minus_01_dot_40 DrawerType)
        (objectType Pencil_bar__plus_01_dot_52_bar__plus_00_dot_75_bar__minus_01_dot_30 PencilType)
        (objectType Pencil_bar__minus_01_dot_34_bar__plus_00_dot_34_bar__plus_01_dot_83 PencilType)
        (canContain DeskType PencilType)
        (canContain ShelfType PencilType)
        (canContain DrawerType PencilType)
        (openable Drawer_bar__plus_01_dot_38_bar__plus_00_dot_59_bar__minus_01_dot_40)
        (pickupable Pencil_bar__plus_01_dot_52_bar__plus_00_dot_75_bar__minus_01_dot_30)
        (pickupable Pencil_bar__minus_01_dot_34_bar__plus_00_dot_34_bar__plus_01_dot_83)
        (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_30)
        (receptacleAtLocation Desk_bar__plus_01_dot_50_bar__plus_00_dot_00_bar__minus_01_dot_45 loc_bar_5_bar__minus_3_bar_2_bar_45)
        (receptacleAtLocation Shelf_bar__minus_01_dot_36_bar__plus_00_dot_34_bar__plus_01_dot_80 loc_bar__minus_4_bar_5_bar_0_bar_60)
        (receptacleAtLocation Drawer_bar__plus_01_dot_38_bar__plus_00_dot_59_bar__minus_01_dot_40 loc_bar_4_bar__minus_3_bar_2_bar_30)
        (inReceptacle Pencil_bar__plus_01_dot_52_bar__plus_00_dot_75_bar__minus_01_dot_30 Desk_bar__plus_01_dot_50_bar__plus_00_dot_00_bar__minus_01_dot_45)
        (inReceptacle Pencil_bar__minus_01_dot_34_bar__plus_00_dot_34_bar__plus_01_dot_83 Shelf_bar__minus_01_dot_36_bar__plus_00_dot_34_bar__plus_01_dot_80)
        (objectAtLocation Pencil_bar__plus_01_dot_52_bar__plus_00_dot_75_bar__minus_01_dot_30 loc_bar_5_bar__minus_3_bar_2_bar_45)
        (objectAtLocation Pencil_bar__minus_01_dot_34_bar__plus_00_dot_34_bar__plus_01_dot_83 loc_bar__minus_4_bar_5_bar_0_bar_60)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o1 - object)
                    (and
                        (objectType ?o1 PencilType)
                        (receptacleType ?r DrawerType)
                        (inReceptacle ?o1 ?r)
                        (exists (?o2 - object)
                            (and
                                (not (= ?o1 ?o2))
                                (objectType ?o2 PencilType)
                                (receptacleType ?r DrawerType)
                                (inReceptacle ?o2 ?r)
                            )
                        )
                    )
                )
            )
        )
    )
)
