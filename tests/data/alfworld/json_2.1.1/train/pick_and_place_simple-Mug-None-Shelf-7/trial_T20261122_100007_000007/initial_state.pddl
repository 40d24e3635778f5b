(define (problem plan_trial_T20261122_100007_000007)
    (:domain alfred)
    (:objects
        agent1 - agent
        MugType - otype
        CounterTopType - rtype
        ShelfType - rtype
        Mug_bar__minus_00_dot_62_bar__plus_00_dot_95_bar__minus_01_dot_90 - object
        CounterTop_bar__minus_00_dot_50_bar__plus_00_dot_95_bar__minus_01_dot_80 - receptacle
        Shelf_bar__plus_01_dot_20_bar__plus_01_dot_50_bar__minus_01_dot_90 - receptacle
        loc_bar__minus_2_bar__minus_5_bar_2_bar_45 - location
        loc_bar_5_bar__minus_5_bar_2_bar_0 - location
        loc_bar_0_bar_0_bar_2_bar_30 - location
        )
    (:init
        (receptacleType CounterTop_bar__minus_00_dot_50_bar__plus_00_dot_95_bar__minus_01_dot_80 CounterTopType)
        (receptacleType Shelf_bar__plus_01_dot_20_bar__plus_01_dot_50_bar__minus_01_dot_90 ShelfType)
        (objectType Mug_bar__minus_00_dot_62_bar__plus_00_dot_95_bar__minus_01_dot_90 MugType)
        (canContain CounterTopType MugType)
        (pickupable Mug_bar__minus_00_dot_62_bar__plus_00_dot_95_bar__minus_01_dot_90)
        (atLocation agent1 loc_bar_0_bar_0_bar_2_bar_30)
        (receptacleAtLocation CounterTop_bar__minus_00_dot_50_bar__plus_00_dot_95_bar__minus_01_dot_80 loc_bar__minus_2_bar__minus_5_bar_2_bar_45)
        (receptacleAtLocation Shelf_bar__plus_01_dot_20_bar__plus_01_dot_50_bar__minus_01_dot_90 loc_bar_5_bar__minus_5_bar_2_bar_0)
        (inReceptacle Mug_bar__minus_00_dot_62_bar__plus_00_dot_95_bar__minus_01_dot_90 CounterTop_bar__minus_00_dot_50_bar__plus_00_dot_95_bar__minus_01_dot_80)
        (objectAtLocation Mug_bar__minus_00_dot_62_bar__plus_00_dot_95_bar__minus_01_dot_90 loc_bar__minus_2_bar__minus_5_bar_2_bar_45)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (inReceptacle ?o ?r)
                        (objectType ?o MugType)
                        (receptacleType ?r ShelfType)
                    )
                )
            )
        )
    )
)
